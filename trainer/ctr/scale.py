"""What ``rpcps bench scale`` needs of the CTR workload beyond flags: the data of the user-model
case (the DeepFM of ``examples/`` over generated movie ratings) and requests for a serving member."""
from __future__ import annotations

import random
import subprocess
import sys
from pathlib import Path
from typing import Any

from services.errors import ConfigError

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
RATINGS = 200_000


def movies(folder: Path) -> tuple[list[str], Path]:
    """Writes the ratings into ``folder``; the flags of the example's model over them, and the
    folder its model is imported from (``examples/``, which only a source checkout has)."""
    model = EXAMPLES / "movies_deepfm"
    if not (model / "model.py").exists():
        raise ConfigError(f"the user-model case trains the example in {model}, which is not here: run the bench "
                          f"from a source checkout, or leave the case out (--cases)")
    data = folder / "ratings"
    done = subprocess.run([sys.executable, "-m", "supervise.cli", "data", "ratings", "--rows", str(RATINGS),
                           "--out", str(data)], capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        raise RuntimeError(f"rpcps data ratings failed: {done.stderr[-2000:]}")
    return ["--model", "movies_deepfm.model:DeepFM", "--schema", str(model / "movies.yaml"), "--data", str(data),
            "--optimizer", "adagrad"], EXAMPLES


def rows(count: int, seed: int = 1) -> list[dict[str, Any]]:
    """``count`` Criteo-shaped rows as a client sends them to the built-in DLRM's ``/predict``."""
    from rpcps.data.generated import CATEGORICAL, DENSE       # loads torch: not when the CLI lists commands
    draw = random.Random(seed)
    return [{**{f"I{j + 1}": draw.randrange(0, 100) for j in range(DENSE)},
             **{f"C{t + 1}": f"{draw.getrandbits(32):08x}" for t in range(CATEGORICAL)}} for _ in range(count)]
