"""The XLA flags trainrun sets by default: here and nowhere else, each with its measured effect.

XLA reads ``XLA_FLAGS`` once, when JAX starts its backend (the first computation or device
query). ``import trainrun`` adds these flags to the environment, which is before that in any
program that imports trainrun before computing; child processes (the CLI, the multi-process
launcher) inherit them. A flag already named in ``XLA_FLAGS`` is left as the user set it, and
every run records the ``XLA_FLAGS`` it ran with in its provenance.

``--xla_cpu_experimental_ynn_fusion_type=`` (empty: no YNNPACK fusions on CPU)
    jaxlib 0.10's XLA:CPU hands dots, with the elementwise ops and reductions around them, to
    YNNPACK. To feed those fusions it writes broadcasts out in full (a layer norm's scale, a
    softmax's normalizer, each a whole activation-sized array), and for the transformer's
    shapes its dots take more CPU time than XLA's Eigen dots. Measured on this repository's
    2-core CPU (BENCHMARKS.md, "The LM against PyTorch on CPU"): the byte LM's training step
    about 10% less CPU time and 10-20% less wall time, ``configs/lm.yaml`` 4% less CPU time,
    the MLP and the digits CNN unchanged. The flag changes the rounding of CPU matmuls, so runs
    differ in their last bits from runs without it; a program that imports trainrun before it
    computes has it on both sides of any comparison.
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping
from importlib import metadata

# flag -> value. Only for jaxlib releases whose XLA knows the flag: XLA aborts the process at
# backend start on a flag it does not know.
DEFAULT_FLAGS = {"--xla_cpu_experimental_ynn_fusion_type": ""}
KNOWN_JAXLIB = ("0.10.",)


def apply_default_flags(environ: MutableMapping[str, str] = os.environ) -> list[str]:
    """Add the default flags the user has not set to ``XLA_FLAGS``; returns those added."""
    try:
        jaxlib = metadata.version("jaxlib")
    except metadata.PackageNotFoundError:
        return []
    if not jaxlib.startswith(KNOWN_JAXLIB):
        return []
    flags = environ.get("XLA_FLAGS", "")
    added = [f"{name}={value}" for name, value in DEFAULT_FLAGS.items()
             if name.lstrip("-") not in flags]
    if added:
        environ["XLA_FLAGS"] = " ".join([flags, *added]).strip()
    return added
