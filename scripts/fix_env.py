"""Remove torchvision, torchaudio and torchcodec when they fail to import beside the installed torch.

PyPI's builds of these link against CUDA torch; beside the CPU torch they fail at import, and transformers
(imported by vLLM) then fails too. Text models need none of them.
"""

import importlib.util
import subprocess
import sys

BROKEN_IF_PRESENT = ("torchvision", "torchaudio", "torchcodec")


def imports_cleanly(module: str) -> bool:
    result = subprocess.run([sys.executable, "-c", f"import {module}"], capture_output=True, text=True)
    return result.returncode == 0


def main() -> None:
    for module in BROKEN_IF_PRESENT:
        if importlib.util.find_spec(module) is None or imports_cleanly(module):
            continue
        print(f"fix_env: {module} fails to import beside this torch; uninstalling it (text models do not need it)")
        subprocess.run([sys.executable, "-m", "pip", "uninstall", "-q", "-y", module], check=True)


if __name__ == "__main__":
    main()
