import os
import sys

# Tests import their shared helpers (batches.py) by module name.
sys.path.insert(0, os.path.dirname(__file__))

import atexit
import shutil
import tempfile

# The compile cache is on by default and lives in ~/.cache/fullcg: the suite must neither
# write there nor depend on what an earlier run left. Tests run with it off, in a private
# directory; the compile-cache tests turn it on for themselves.
_cache_dir = tempfile.mkdtemp(prefix="fullcg-test-cache-")
atexit.register(shutil.rmtree, _cache_dir, True)
os.environ["FULLCG_CACHE_DIR"] = _cache_dir
os.environ["FULLCG_DISABLE_COMPILE_CACHE"] = "1"
# Inductor's own caches too: an entry carries the shape guards of the process that wrote it
# (a stale one can add a guard that today's code no longer produces).
os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(_cache_dir, "inductor")
