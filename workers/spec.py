"""Re-export: the job spec lives in the config package ``csx_config`` (pydantic and yaml only)."""

from csx_config import *  # noqa: F401,F403
from csx_config import __all__  # noqa: F401
