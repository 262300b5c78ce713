-- MLflow keeps its own database beside the service's (created once, on an empty volume).
CREATE DATABASE mlflow OWNER csx;
-- MLflow's users and permissions (its basic-auth app, docker/mlflow-auth.ini).
CREATE DATABASE mlflow_auth OWNER csx;
