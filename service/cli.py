"""`csx serve | token | submit | study`: registered into csx/cli.py's parser lazily.

    csx serve [--host 127.0.0.1] [--port 8000] [--dev-token] [--paused] [--no-mlflow-ui]
    csx token create --name N [--admin]              # prints the secret once
    csx token list | csx token revoke --name N
    csx submit --params P.yaml [--num_csx N] [--mode M] [--name N] [--priority P]
    csx study --params P.yaml --name N --algorithms dense,static,set,rigl,granet --sparsity 0.9
    csx local-study [--study examples/study_baby_gpt.yaml] [--state-dir .csx] [--no-wait]  # `make run`

Client commands talk to --url (default $CSX_URL or http://127.0.0.1:8000) with --token
(default $CSX_TOKEN).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from pathlib import Path
from typing import Any

DEFAULT_URL = "http://127.0.0.1:8000"


def register(subparsers: argparse._SubParsersAction) -> None:
    serve = subparsers.add_parser("serve", help="run the REST API and scheduler")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--dev-token", action="store_true", help="print a fresh admin token")
    serve.add_argument("--paused", action="store_true", help="queue jobs but start none")
    serve.add_argument("--workers", type=int, default=None,
                       help="API processes on the port, a core each at most; one schedules, "
                            "the others stand by (default: CSX_API_WORKERS, else 2, or 1 on "
                            "one core)")
    serve.add_argument("--no-mlflow-ui", action="store_true",
                       help="log straight into a SQLite CSX_MLFLOW_TRACKING_URI (its records then "
                            "hold absolute artifact paths) instead of through an MLflow UI")
    serve.set_defaults(handler=serve_command)

    token = subparsers.add_parser("token", help="manage API tokens")
    actions = token.add_subparsers(dest="action", required=True)
    create = actions.add_parser("create", help="create a token and print its secret once")
    create.add_argument("--name", required=True)
    create.add_argument("--admin", action="store_true", help="may see every user's jobs")
    create.set_defaults(handler=token_create_command)
    listing = actions.add_parser("list", help="the tokens: name, admin, created, revoked")
    listing.set_defaults(handler=token_list_command)
    revoke = actions.add_parser("revoke", help="end a token: its secret stops working at once "
                                               "(its jobs stay; `create` gives the name a new one)")
    revoke.add_argument("--name", required=True)
    revoke.set_defaults(handler=token_revoke_command)

    submit = subparsers.add_parser("submit", help="submit a params YAML as a job")
    _client_options(submit)
    submit.add_argument("--num_csx", type=int)
    submit.add_argument("--mode", choices=("train", "eval", "train_and_eval", "eval_all"))
    submit.add_argument("--name")
    submit.add_argument("--priority", type=int)
    submit.set_defaults(handler=submit_command)

    study = subparsers.add_parser("study", help="run one params YAML under several algorithms")
    _client_options(study)
    study.add_argument("--name", required=True)
    study.add_argument("--algorithms", default="dense,static,set,rigl,granet",
                       help="comma-separated: dense, static, set, rigl, granet")
    study.add_argument("--sparsity", type=float, required=True)
    study.add_argument("--num_csx", type=int)
    study.set_defaults(handler=study_command)

    local = subparsers.add_parser(
        "local-study", help="start API, Ray and MLflow UI locally, run a study YAML, report")
    local.add_argument("--study", type=Path, default=Path("examples/study_baby_gpt.yaml"),
                       help="a POST /v1/studies body as YAML")
    local.add_argument("--state-dir", type=Path, default=Path(".csx"),
                       help="databases, MLflow store, checkpoints and logs")
    local.add_argument("--api-port", type=int, default=0, help="0: a free port")
    local.add_argument("--ui-port", type=int, default=0, help="0: a free port")
    local.add_argument("--cluster-size", type=int, default=None,
                       help="simulated CS-2 systems (one CPU each) shared by the variants "
                            "(default: one per core with every core, or one per GPU)")
    local.add_argument("--no-wait", action="store_true",
                       help="stop the stack after the report instead of keeping the UI up")
    local.set_defaults(handler=local_study_command)


def _client_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--params", required=True, type=Path, help="ModelZoo params YAML")
    parser.add_argument("--url", default=os.environ.get("CSX_URL", DEFAULT_URL))
    parser.add_argument("--token", default=os.environ.get("CSX_TOKEN"))


def default_api_workers() -> int:
    """API processes `csx serve` runs unless told: two answer 50 clients twice as fast as one
    on a 2-core VM (docs/benchmarks.md); more were not measured."""
    from workers.hardware import usable_cores

    return min(2, usable_cores())


# Set in the API process `csx serve` runs and restarts (`_supervise_api`).
API_PROCESS_ENV = "CSX_SERVE_API_PROCESS"
MAX_API_RESTARTS = 5
API_RESTART_WINDOW_S = 600.0


def serve_command(args: argparse.Namespace) -> int:
    """`csx serve` runs the API in a child process and restarts it when it dies (losing the
    local Ray head ends a Ray driver's process a minute later); the restarted one takes the
    dead one's lease at once and resumes its jobs from their last checkpoints."""
    from service.settings import Settings

    # Checked once here: a bad --workers would fail every restart of the API process.
    Settings(**serve_overrides(args)).check_clear_of_ray_workers(args.port)
    if os.environ.get(API_PROCESS_ENV) == "1":
        return _serve_api(args)
    return _supervise_api(args)


def _supervise_api(args: argparse.Namespace) -> int:
    import subprocess
    import time
    from functools import partial

    from service.processes import check_port_free, term_on_parent_death
    from service.settings import Settings

    argv = [sys.executable, "-m", "service.cli", "serve", "--host", args.host,
            "--port", str(args.port)]
    argv += ["--paused"] * args.paused + ["--no-mlflow-ui"] * args.no_mlflow_ui
    argv += ["--workers", str(args.workers)] if args.workers is not None else []
    settings = Settings()
    ports = [args.port]
    if settings.mlflow_tracking_uri.startswith("sqlite:") and not args.no_mlflow_ui:
        from urllib.parse import urlsplit

        ports += [port] if (port := urlsplit(settings.mlflow_ui_url).port) else []
    env = {**os.environ, API_PROCESS_ENV: "1"}
    stopping = False
    child: subprocess.Popen[bytes] | None = None

    def forward(signum: int, _frame: Any) -> None:
        nonlocal stopping
        stopping = True
        if child is not None and child.poll() is None:
            child.send_signal(signum)

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    deaths: list[float] = []
    dev_token = args.dev_token
    while True:
        # The child gets SIGTERM if this supervisor dies, even by SIGKILL.
        child = subprocess.Popen(argv + ["--dev-token"] * dev_token, env=env,
                                 preexec_fn=partial(term_on_parent_death, os.getpid()))
        dev_token = False  # the token printed at the first start stays valid across restarts
        code = child.wait()
        if stopping or code == 0:
            return 0 if stopping else code
        now = time.monotonic()
        deaths = [t for t in deaths if now - t < API_RESTART_WINDOW_S] + [now]
        if len(deaths) > MAX_API_RESTARTS:
            print(f"csx serve: the API process died {len(deaths)} times in "
                  f"{API_RESTART_WINDOW_S / 60:.0f} minutes; giving up", file=sys.stderr)
            return code or 1
        print(f"csx serve: the API process exited with code {code}; restarting it",
              file=sys.stderr, flush=True)
        deadline = time.monotonic() + 60  # its servers' watchers free their ports
        for port in ports:
            while time.monotonic() < deadline:
                try:
                    check_port_free(port)
                    break
                except ValueError:
                    time.sleep(0.5)


def _serve_api(args: argparse.Namespace) -> int:
    import uvicorn

    from service.main import KEEP_ALIVE_S, WORKER_HEALTHCHECK_S, create_app
    from service.processes import MLFLOW_ARTIFACTS, StackError
    from service.settings import Settings

    settings = Settings(**serve_overrides(args))
    if "api_workers" not in settings.model_fields_set:  # neither --workers nor CSX_API_WORKERS
        settings = settings.model_copy(update={"api_workers": default_api_workers()})
    ui = None
    if settings.mlflow_tracking_uri.startswith("sqlite:") and not args.no_mlflow_ui:
        # Runs logged through the UI's artifact proxy record `mlflow-artifacts:/` locations, not
        # absolute file:// paths: the store opens from a copy (docs/studies.md, "Comparing the
        # variants in MLflow").
        from service.supervised import MlflowUI

        store = Path(settings.mlflow_tracking_uri.removeprefix("sqlite:///"))
        settings = with_ui_admin(settings, store)
        try:
            ui = MlflowUI(store=store, url=settings.mlflow_ui_url, access=settings.mlflow_access,
                          log_path=settings.runs_dir / "mlflow-ui.log")
        except StackError as err:
            print(f"csx serve: {err}", file=sys.stderr)
            return 1
        sign_in = ("sign in with GET /v1/mlflow/credentials" if settings.mlflow_access
                   else "open: one user")
        print(f"MLflow UI: {ui.url} ({sign_in}; store {store}, artifacts "
              f"{store.parent / MLFLOW_ARTIFACTS})", flush=True)
        settings = settings.model_copy(update={"mlflow_tracking_uri": ui.url,
                                               "mlflow_ui_url": ui.url})
    print(found_cluster(settings), flush=True)
    # uvicorn re-raises a SIGTERM with the handler it found once it has shut down gracefully;
    # the default one would end the process by the signal: a stop that went well exits 0.
    signal.signal(signal.SIGTERM, lambda *_: None)
    try:
        if settings.api_workers == 1:
            uvicorn.run(create_app(settings, tune_collector=True), host=args.host,
                        port=args.port, timeout_keep_alive=KEEP_ALIVE_S)
        else:
            _prepare_workers(settings)
            uvicorn.run("service.main:app", workers=settings.api_workers, host=args.host,
                        port=args.port, timeout_keep_alive=KEEP_ALIVE_S,
                        timeout_worker_healthcheck=WORKER_HEALTHCHECK_S)
    finally:
        if ui is not None:
            ui.close()
    return 0


def serve_overrides(args: argparse.Namespace) -> dict[str, Any]:
    """The settings `csx serve`'s flags set."""
    overrides: dict[str, Any] = {}
    if args.dev_token:
        overrides["dev_token"] = True
    if args.paused:
        overrides["paused"] = True
    if args.workers is not None:
        overrides["api_workers"] = args.workers
    return overrides


def _prepare_workers(settings: Any) -> None:
    """What one process does before uvicorn starts `settings.api_workers` of them: migrate the
    database (two workers migrating one at once fail) and print the dev token (each worker
    would rotate it); then the workers' settings, which they build from the environment
    (`service.main:app`), get what this process's settings changed."""
    from service.db import make_engine, make_sessionmaker, upgrade_database
    from service.main import print_dev_token

    if settings.run_migrations_on_start:
        upgrade_database(settings.database_url)
    if settings.dev_token:
        engine = make_engine(settings.database_url)
        print_dev_token(make_sessionmaker(engine))
        engine.dispose()
    os.environ.update({
        "CSX_API_WORKERS": str(settings.api_workers), "CSX_PAUSED": str(settings.paused),
        "CSX_DEV_TOKEN": "false", "CSX_RUN_MIGRATIONS_ON_START": "false",
        "CSX_MLFLOW_TRACKING_URI": settings.mlflow_tracking_uri,
        "CSX_MLFLOW_UI_URL": settings.mlflow_ui_url})
    if settings.mlflow_admin_password is not None:
        os.environ["CSX_MLFLOW_ADMIN_PASSWORD"] = settings.mlflow_admin_password.get_secret_value()


def with_ui_admin(settings: Any, store: Path) -> Any:
    """`settings` with an MLflow admin password for the UI csx serve runs over `store` when its
    database holds several users (one user's runs must not show to another): the one made for
    this store before, else a new one. As they were with one user, or a password given."""
    if settings.mlflow_admin_password is not None or _user_count(settings) <= 1:
        return settings
    from pydantic import SecretStr

    from service.mlflow_auth import stored_admin_password

    store.parent.mkdir(parents=True, exist_ok=True)
    password = SecretStr(stored_admin_password(store.parent))
    return settings.model_copy(update={"mlflow_admin_password": password})


def _user_count(settings: Any) -> int:
    """Users (tokens) in the service's database; 0 before its first migration."""
    from sqlalchemy.exc import OperationalError, ProgrammingError

    from service import crud
    from service.db import make_engine, make_sessionmaker

    engine = make_engine(settings.database_url)
    try:
        with make_sessionmaker(engine)() as session:
            return crud.user_count(session)
    except (OperationalError, ProgrammingError):  # no tokens table yet
        return 0
    finally:
        engine.dispose()


def found_cluster(settings: Any) -> str:
    """What the service will run jobs on: the cluster in RAY_ADDRESS (joined now, as a
    driver), else the local Ray head it starts with the first job."""
    from service.cluster import describe, live_summary, machine_summary

    address = os.environ.get("RAY_ADDRESS")
    if not address:
        return describe(machine_summary(settings.cluster_size),
                        "local Ray head, started with the first job")
    from workers.runner import connect_ray

    connect_ray(systems=1, address=address)
    return describe(live_summary(), f"Ray cluster at {address}")


def _token_session(change: Any) -> Any:
    """`change(session)` on the database of CSX_DATABASE_URL (migrated first), committed."""
    from service.db import make_engine, make_sessionmaker, upgrade_database
    from service.settings import Settings

    settings = Settings()
    upgrade_database(settings.database_url)
    engine = make_engine(settings.database_url)
    try:
        with make_sessionmaker(engine)() as session:
            result = change(session)
            session.commit()
            return result
    finally:
        engine.dispose()


def token_list_command(args: argparse.Namespace) -> int:
    from service import crud

    rows = _token_session(lambda session: [
        (t.name, "admin" if t.is_admin else "user", t.created_at.isoformat(timespec="seconds"),
         f"revoked {t.revoked_at.isoformat(timespec='seconds')}" if t.revoked_at else "active")
        for t in crud.list_tokens(session)])
    for row in rows:
        print("\t".join(row))
    return 0


def token_revoke_command(args: argparse.Namespace) -> int:
    from service import crud

    _token_session(lambda session: crud.revoke_token(session, name=args.name))
    print(f"token {args.name!r} revoked", file=sys.stderr)
    return 0


def token_create_command(args: argparse.Namespace) -> int:
    from service import crud
    from service.settings import Settings

    settings = Settings()

    def create(session: Any) -> tuple[str, int]:
        _, secret = crud.create_token(session, name=args.name, is_admin=args.admin)
        session.flush()
        return secret, crud.user_count(session)

    secret, users = _token_session(create)
    print(secret)
    if users == 2 and settings.mlflow_admin_password is None:
        print("csx token: this is the second user: restart csx serve so that the MLflow UI it "
              "runs asks each user to sign in (GET /v1/mlflow/credentials)", file=sys.stderr)
    return 0


def submit_command(args: argparse.Namespace) -> int:
    import yaml

    body = yaml.safe_load(args.params.read_text(encoding="utf-8")) or {}
    for option in ("num_csx", "mode", "name", "priority"):
        if getattr(args, option) is not None:
            body[option] = getattr(args, option)
    return _post(args, "/v1/jobs", body)


def study_command(args: argparse.Namespace) -> int:
    import yaml

    body: dict[str, Any] = {
        "name": args.name,
        "params": yaml.safe_load(args.params.read_text(encoding="utf-8")) or {},
        "algorithms": [a.strip() for a in args.algorithms.split(",") if a.strip()],
        "sparsity": args.sparsity,
    }
    if args.num_csx is not None:
        body["num_csx"] = args.num_csx
    return _post(args, "/v1/studies", body)


def local_study_command(args: argparse.Namespace) -> int:
    from service.local_stack import run_local_study
    from service.processes import StackError

    try:
        return run_local_study(args.study, state_dir=args.state_dir, api_port=args.api_port,
                               ui_port=args.ui_port, cluster_size=args.cluster_size,
                               keep_ui=not args.no_wait)
    except StackError as err:
        print(f"csx local-study: {err}", file=sys.stderr)
        return 1


def _post(args: argparse.Namespace, path: str, body: dict[str, Any]) -> int:
    import httpx

    if not args.token:
        raise ValueError("no token: pass --token or set CSX_TOKEN (see `csx token create`)")
    response = httpx.post(args.url.rstrip("/") + path, json=body, timeout=120,
                          headers={"Authorization": f"Bearer {args.token}"})
    print(json.dumps(response.json(), indent=2))
    return 0 if response.is_success else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m service.cli")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    try:
        return args.handler(args)
    except ValueError as err:
        print(f"csx {args.command}: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
