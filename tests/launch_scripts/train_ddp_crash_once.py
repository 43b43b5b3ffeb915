"""scripts/train_ddp.py with rank 1 killed as epoch 1 starts, on torchrun's first attempt
only (TORCHELASTIC_RESTART_COUNT=0): the restarted ranks resume from the checkpoint.

Arguments are scripts/train_ddp.py's. The kill is chapter 09's crash lab
(mgpu_helpers.labs.debug_labs.rank_killed_at_epoch), not a switch of the script.
"""

import runpy
import sys
from pathlib import Path

from mgpu_helpers.labs.debug_labs import rank_killed_at_epoch

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "train_ddp.py"

with rank_killed_at_epoch(1, victim=1):  # on the first attempt only
    sys.argv = [str(SCRIPT), *sys.argv[1:]]
    runpy.run_path(str(SCRIPT), run_name="__main__")
