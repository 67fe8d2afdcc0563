"""Make sure torch is importable, without ever replacing an installed torch.

- torch already importable (a user's CUDA build, say): keep it as it is, install nothing.
- otherwise, on a machine with an NVIDIA GPU (nvidia-smi present): `pip install torch`.
- otherwise: a CPU build, `torch==2.13.0+cpu`, from pip's configured sources first, then from
  the PyTorch CPU wheel index; never the default CUDA wheels (several GB) on a machine without a GPU.
"""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys

CPU_BUILD = "torch==2.13.0+cpu"
CPU_INDEX = "https://download.pytorch.org/whl/cpu"


def pip(*args: str) -> bool:
    return subprocess.call([sys.executable, "-m", "pip", "install", "-q", *args]) == 0


def main() -> int:
    if importlib.util.find_spec("torch") is not None:
        import torch

        print(f"ensure_torch: keeping the installed torch {torch.__version__}")
        return 0
    if shutil.which("nvidia-smi"):
        print("ensure_torch: no torch installed and a GPU is present: installing torch (CUDA build)")
        return 0 if pip("torch") else 1
    print(f"ensure_torch: no torch installed and no GPU: installing the CPU build {CPU_BUILD}")
    if pip(CPU_BUILD) or pip(CPU_BUILD, "--index-url", CPU_INDEX, "--timeout", "20", "--retries", "1"):
        return 0
    print(
        f"ensure_torch: could not install {CPU_BUILD}. Install a torch build yourself "
        f"(e.g. pip install torch --index-url {CPU_INDEX}) and run this again.",
        file=sys.stderr,
    )
    return 1


if __name__ == "__main__":
    sys.exit(main())
