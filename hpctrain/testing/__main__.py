"""``python -m hpctrain.testing <command> ...``: ``python -m hpctrain <command> ...`` on numba's CUDA
simulator made safe for concurrent launches first (:mod:`.simulator`); on a GPU the same run as
``python -m hpctrain``. For dry runs of the GPU paths without a GPU (scripts/gpu-check.sh --simulate).
"""

import sys

from ..runtime import limit_threads_per_rank

if __name__ == "__main__":
    limit_threads_per_rank()  # before numpy is imported, as python -m hpctrain does
    from ..__main__ import main
    from .simulator import make_thread_safe

    make_thread_safe()
    sys.exit(main())
