"""`csx token create` through csx/cli.py's lazy plugin hook."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from service import crud
from service.db import make_engine, make_sessionmaker
from service.models import Token


def _csx(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "csx.cli", *args], capture_output=True,
                          text=True, env=env, timeout=120)


def test_token_create_stores_only_the_hash(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'csx.db'}"
    env = {"PATH": "/usr/bin:/bin", "CSX_DATABASE_URL": url}
    created = _csx("token", "create", "--name", "carol", "--admin", env=env)
    assert created.returncode == 0, created.stderr
    secret = created.stdout.strip().splitlines()[-1]
    assert secret.startswith("csx_") and len(secret) > 40
    engine = make_engine(url)
    with make_sessionmaker(engine)() as session:
        caller = crud.get_caller(session, secret=secret)
        assert caller is not None and caller.name == "carol" and caller.is_admin
        token = session.get(Token, caller.id)
        assert token.token_hash == crud.hash_secret(secret) and secret not in token.token_hash
    engine.dispose()
    duplicate = _csx("token", "create", "--name", "carol", env=env)
    assert duplicate.returncode == 2 and "already exists" in duplicate.stderr
