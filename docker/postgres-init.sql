-- MLflow keeps its own database beside the service's (created once, on an empty volume).
CREATE DATABASE mlflow OWNER csx;
