"""MLflow behind its own authentication wherever the service has several users.

The REST API shows each user only their own jobs; an open MLflow server would let any local
process read and delete every user's runs around that. So a multi-user deployment runs MLflow's
basic-auth app (`mlflow server --app-name basic-auth`) with nothing allowed by default
(`default_permission = NO_PERMISSIONS`) and an admin account the service owns:

- the service and its job workers log with that account (MLFLOW_TRACKING_USERNAME/PASSWORD,
  set in the service's process and handed to the workers' runtime environment only);
- each service user (a token's name) gets an MLflow user of the same name, whose password is
  derived from the admin password (an HMAC: nothing more to store, and it changes with it);
- a user's experiments are named `<user>/<experiment>`, so two users' same-named experiments
  are two experiments; the service creates each one itself and logs only into those
  (service/experiments.py), and the user is granted READ on each as it is created;
- a user learns their MLflow credentials from `GET /v1/mlflow/credentials`.

`make run`'s single-user stack on 127.0.0.1 stays open (no admin password: no authentication).
"""

from __future__ import annotations

import configparser
import hashlib
import hmac
import os
import secrets
from dataclasses import dataclass, field
from pathlib import Path

# MLflow's client reads a tracking server's credentials from these (mlflow.environment_variables).
USERNAME_ENV = "MLFLOW_TRACKING_USERNAME"
PASSWORD_ENV = "MLFLOW_TRACKING_PASSWORD"
CREDENTIALS_ENV = (USERNAME_ENV, PASSWORD_ENV)
READ = "READ"
ALREADY_EXISTS = "RESOURCE_ALREADY_EXISTS"
# The auth app's REST routes (mlflow.server.auth.routes, which imports MLflow's whole server).
CREATE_USER = "/api/2.0/mlflow/users/create"
UPDATE_USER_PASSWORD = "/api/2.0/mlflow/users/update-password"
GRANT_USER_PERMISSION = "/api/3.0/mlflow/users/permissions/grant"
REQUEST_TIMEOUT_S = 10.0
# MLflow checks a password with PBKDF2 on every request unless told to cache a check: the
# workers' metric batches would each pay it. One server process (--workers 1) drops its cache
# entry when a password changes through its API, which is the only way this service changes one.
AUTH_CACHE_TTL_S = 60
AUTH_CONFIG_FILE = "mlflow-auth.ini"
AUTH_DATABASE = "mlflow-auth.db"
ADMIN_SECRET_FILE = "mlflow-admin.secret"


class MlflowUnavailable(RuntimeError):
    """The MLflow server cannot be reached or failed: worth retrying later."""


@dataclass(frozen=True)
class MlflowAccess:
    """The service's admin account on an MLflow server running the basic-auth app."""

    tracking_uri: str
    admin_username: str
    admin_password: str = field(repr=False)

    def password_for(self, user: str) -> str:
        digest = hmac.new(self.admin_password.encode(), f"csx-mlflow-user:{user}".encode(),
                          hashlib.sha256)
        return digest.hexdigest()[:32]

    def ensure_user(self, user: str) -> str:
        """Create `user` on the MLflow server (or reset its password to the derived one, after
        an admin password change) and return its password."""
        if user == self.admin_username:
            raise ValueError(f"token name {user!r} is the service's MLflow admin account "
                             "(CSX_MLFLOW_ADMIN_USERNAME); give the user another name")
        password = self.password_for(user)
        body = {"username": user, "password": password}
        if not self._call("POST", CREATE_USER, body, allow_existing=True):
            self._call("PATCH", UPDATE_USER_PASSWORD, body)
        return password

    def grant_read(self, user: str, experiment_ids: list[str]) -> None:
        """`user` may read (not change or delete) the runs of these experiments."""
        self.ensure_user(user)
        for experiment_id in experiment_ids:
            # Granted before: READ is all this ever grants, so nothing to change.
            self._call("POST", GRANT_USER_PERMISSION, {
                "username": user, "resource_type": "experiment", "resource_id": experiment_id,
                "permission": READ}, allow_existing=True)

    def _call(self, method: str, path: str, body: dict[str, str], *,
              allow_existing: bool = False) -> bool:
        """One admin request, bounded (MLflow's own client retries for minutes): False if it
        found the thing there already and `allow_existing`; MlflowUnavailable if the server
        cannot be reached or refuses the admin account."""
        import httpx

        try:
            response = httpx.request(method, self.tracking_uri.rstrip("/") + path, json=body,
                                     auth=(self.admin_username, self.admin_password),
                                     timeout=REQUEST_TIMEOUT_S)
        except httpx.TransportError as err:
            raise MlflowUnavailable(f"MLflow at {self.tracking_uri} cannot be reached "
                                    f"({type(err).__name__}: {err})") from err
        if response.is_success:
            return True
        if allow_existing and ALREADY_EXISTS in response.text:
            return False
        if response.status_code >= 500:
            raise MlflowUnavailable(f"MLflow at {self.tracking_uri} answered "
                                    f"{response.status_code} to {path}")
        raise MlflowUnavailable(f"MLflow refused {method} {path} for the service's admin account "
                         f"{self.admin_username!r} ({response.status_code}: "
                         f"{response.text[:200]}); check CSX_MLFLOW_ADMIN_USERNAME/PASSWORD")

    def use_in_this_process(self) -> None:
        """MLflow's client in this process (the service's own calls, and the runs it opens for
        jobs) authenticates as the admin; the job's workers get the same through their Ray
        runtime environment (workers/runner.py)."""
        os.environ[USERNAME_ENV] = self.admin_username
        os.environ[PASSWORD_ENV] = self.admin_password


def experiment_name(access: MlflowAccess | None, owner: str, experiment: str) -> str:
    """The MLflow experiment of a user's job or study: per user when MLflow authenticates."""
    return experiment if access is None else f"{owner}/{experiment}"


def server_env(access: MlflowAccess, state_dir: Path) -> dict[str, str]:
    """Environment for `mlflow ui|server --app-name basic-auth` keeping its users in
    `state_dir`: a config file allowing nothing by default, and the admin account."""
    config = configparser.ConfigParser()
    config["mlflow"] = {"default_permission": "NO_PERMISSIONS",
                        "database_uri": f"sqlite:///{state_dir.resolve() / AUTH_DATABASE}",
                        "auth_cache_ttl_seconds": str(AUTH_CACHE_TTL_S)}
    path = state_dir / AUTH_CONFIG_FILE
    with path.open("w", encoding="utf-8") as out:
        config.write(out)
    return {"MLFLOW_AUTH_CONFIG_PATH": str(path.resolve()),
            "MLFLOW_AUTH_ADMIN_USERNAME": access.admin_username,
            "MLFLOW_AUTH_ADMIN_PASSWORD": access.admin_password,
            # The UI's login form needs a CSRF key; sessions end when the server restarts.
            "MLFLOW_FLASK_SERVER_SECRET_KEY": secrets.token_hex(32)}


def stored_admin_password(state_dir: Path) -> str:
    """The admin password `csx serve` made for the MLflow UI it runs over `state_dir` (made
    once, readable by this user only: the auth database keeps the first one)."""
    path = state_dir / ADMIN_SECRET_FILE
    try:
        return path.read_text(encoding="utf-8").strip()
    except FileNotFoundError:
        password = secrets.token_urlsafe(24)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w", encoding="utf-8") as out:
            out.write(password)
        return password
