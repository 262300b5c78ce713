"""Whether an MLflow tracking server answers now, asked in one short request.

MLflow's client retries a refused or silent server for about four minutes (seven retries,
exponential back-off) before it raises: a job starting, a worker logging and a driver ending a
run would each sit that long, deaf to a cancel. They ask `mlflow_unreachable` first and wait for the
server, or keep what they would have sent, while it is away. No torch and no MLflow here: the
service imports this at start-up.
"""

from __future__ import annotations

import ssl
import urllib.error
import urllib.request

# How long one probe waits for its answer.
PROBE_TIMEOUT_S = 5.0
# The events a tracker tells as its server stops answering ("reason": why) and answers again.
MLFLOW_AWAY = "mlflow_away"
MLFLOW_BACK = "mlflow_back"


def mlflow_unreachable(tracking_uri: str) -> str | None:
    """Why the MLflow server at `tracking_uri` does not answer now (a few words for a job's
    status message, naming no host), or None when it answers or is no server (a local store).
    Any answer but a 5xx counts: the server's `/health` needs no account, and a refusal of
    this request (401, a certificate MLflow's client is told to accept) is the server's own."""
    if not tracking_uri.startswith(("http://", "https://")):
        return None
    timeout_s = PROBE_TIMEOUT_S
    try:
        with urllib.request.urlopen(tracking_uri.rstrip("/") + "/health", timeout=timeout_s):
            return None
    except urllib.error.HTTPError as err:
        return None if err.code < 500 else f"it answers HTTP {err.code}"
    except urllib.error.URLError as err:
        if isinstance(err.reason, ssl.SSLError):
            return None
        if isinstance(err.reason, TimeoutError):
            return f"no answer within {timeout_s:g} s"
        return str(getattr(err.reason, "strerror", None) or err.reason).lower()
    except TimeoutError:
        return f"no answer within {timeout_s:g} s"
    except OSError as err:
        return str(err.strerror or err).lower()
