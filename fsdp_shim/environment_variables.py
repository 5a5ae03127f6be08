"""The environment variables fsdp-shim reads; what each does: https://fsdp-shim.github.io/fsdp-shim/configuration.html."""

from _fsdp_shim.config import DISABLED_FIXES_VARIABLE as FSDP_SHIM_DISABLED_FIXES
from _fsdp_shim.config import LOG_VARIABLE as FSDP_SHIM_LOG
from _fsdp_shim.config import RANK_CHECK_TIMEOUT_VARIABLE as FSDP_SHIM_RANK_CHECK_TIMEOUT
from _fsdp_shim.config import SHIM_VARIABLE as FSDP_SHIM
from _fsdp_shim.config import STRICT_VARIABLE as FSDP_SHIM_STRICT

__all__ = ["FSDP_SHIM", "FSDP_SHIM_DISABLED_FIXES", "FSDP_SHIM_LOG", "FSDP_SHIM_RANK_CHECK_TIMEOUT", "FSDP_SHIM_STRICT"]
