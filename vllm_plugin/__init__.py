"""kvtether's engine side: a thin vLLM scheduler that reports to the kvtether daemon and
applies its decisions. Select it with::

    --scheduler-cls vllm_plugin.scheduler.KvtetherScheduler --scheduling-policy priority

Settings come from ``KVTETHER_PLUGIN_*`` environment variables (see
``vllm_plugin.settings``). Importing this package imports nothing heavy: vLLM's
modules load only with ``vllm_plugin.scheduler``.
"""

from __future__ import annotations

SCHEDULER_CLS = "vllm_plugin.scheduler.KvtetherScheduler"


def register() -> None:
    """``vllm.general_plugins`` entry point: runs in every vLLM process at start-up.

    Validates the plugin's settings early, so a bad ``KVTETHER_PLUGIN_*`` value stops
    vLLM with a message naming it instead of failing later in the engine process.
    The scheduler itself is selected with ``--scheduler-cls``.
    """
    from vllm_plugin.settings import PluginSettings

    PluginSettings.from_env()
