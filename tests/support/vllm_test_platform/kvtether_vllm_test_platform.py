"""Test harness only: vLLM's CPU platform for the scheduler-level tests of a vLLM
release run from its CUDA wheel's Python files (scripts/test_vllm_versions.py).

Never on the product path: this folder is put on ``PYTHONPATH`` by that script alone,
and its ``.dist-info`` beside this file is what registers the ``vllm.platform_plugins``
entry point (vLLM's documented way to add a platform), so nothing is installed.

Why: from vLLM 0.34.0, ``CpuPlatform.check_and_update_config`` refuses to build any
config on an x86 machine unless ``vllm.triton_utils.HAS_TRITON`` holds ("vLLM on x86
CPUs requires Triton (triton-cpu)"): the 0.34 CPU model runner compiles its kernels
with triton-cpu. No triton-cpu is on the package index, and a CUDA wheel's vLLM
reports no CPU Triton backend even where upstream triton is installed. The
scheduler-level tests build a config, a real ``Scheduler`` and its block pool, and
never run a model, so they need no kernel: this platform is vLLM's ``CpuPlatform``
with that one check seen as passed while the config is completed; everything else is
vLLM's own. A test that ran a model on it would fail in the model runner, not pass.

Selected only when ``VLLM_TARGET_DEVICE`` is not ``cpu`` (vLLM 0.33 on takes that
variable as the final word and loads no platform plugin), and when no other
out-of-tree platform plugin is installed.
"""

from __future__ import annotations

from typing import Any

QUALNAME = "kvtether_vllm_test_platform.SchedulerTestCpuPlatform"


def platform() -> str:
    """The ``vllm.platform_plugins`` entry point: always this platform."""
    return QUALNAME


def _platform_class() -> type:
    # Imported when vLLM resolves the platform, not when the entry point is listed.
    import vllm.triton_utils as triton_utils
    from vllm.platforms.cpu import CpuPlatform

    class SchedulerTestCpuPlatform(CpuPlatform):  # type: ignore[misc, valid-type]
        @classmethod
        def check_and_update_config(cls, vllm_config: Any) -> None:
            # vLLM reads HAS_TRITON from vllm.triton_utils inside this call (0.34.0);
            # it is restored at once so that nothing else takes Triton as present.
            had = triton_utils.HAS_TRITON
            triton_utils.HAS_TRITON = True
            try:
                super().check_and_update_config(vllm_config)
            finally:
                triton_utils.HAS_TRITON = had

    SchedulerTestCpuPlatform.__module__ = __name__
    SchedulerTestCpuPlatform.__qualname__ = "SchedulerTestCpuPlatform"
    return SchedulerTestCpuPlatform


def __getattr__(name: str) -> Any:
    # vLLM imports the platform by its qualified name (resolve_obj_by_qualname); the
    # class is built on that first look-up, once.
    if name == "SchedulerTestCpuPlatform":
        cls = _platform_class()
        globals()[name] = cls
        return cls
    raise AttributeError(name)
