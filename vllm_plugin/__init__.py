"""kvtether's engine side: a thin vLLM scheduler that reports to the kvtether daemon and
applies its decisions. Select it with::

    --scheduler-cls vllm_plugin.scheduler.KvtetherScheduler --scheduling-policy priority

and, in the API server, the request fields of other clients (Continuum's, the vLLM
retention API's) carried to it with::

    --middleware vllm_plugin.http.ClientFieldsMiddleware

Settings come from ``KVTETHER_PLUGIN_*`` environment variables (see
``vllm_plugin.settings``). Importing this package imports nothing heavy: vLLM's
modules load only with ``vllm_plugin.scheduler``.
"""

from __future__ import annotations

SCHEDULER_CLS = "vllm_plugin.scheduler.KvtetherScheduler"
MIDDLEWARE = "vllm_plugin.http.ClientFieldsMiddleware"


def register() -> None:
    """``vllm.general_plugins`` entry point: runs in every vLLM process at start-up.

    Validates the plugin's settings early (vLLM loads its plugins while it parses
    its arguments, before it loads a model): a bad ``KVTETHER_PLUGIN_*`` value or an
    unknown ``KVTETHER_PLUGIN_*`` variable stops vLLM with one line naming it
    (``SystemExit``: no traceback), instead of a traceback from the engine process.
    With ``KVTETHER_PLUGIN_ENABLED=0`` it reads nothing else and never stops vLLM.
    The scheduler itself is selected with ``--scheduler-cls``.
    """
    from vllm_plugin.settings import PluginSettings, PluginSettingsError

    try:
        PluginSettings.from_env()
    except PluginSettingsError as error:
        raise SystemExit(f"kvtether: {error}") from None
