import os
import sys

# Tests import their shared helpers (batches.py) by module name.
sys.path.insert(0, os.path.dirname(__file__))

import atexit
import shutil
import tempfile

import torch

# Without a GPU the Triton kernels run under Triton's CPU interpreter, which is chosen when
# triton is first imported: set here, before any test module (or fullcg) can import it.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

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


def _fullcg_entry_point() -> bool:
    from importlib.metadata import entry_points

    return any(ep.name == "fullcg" and ep.value == "fullcg.backend:fullcg_backend"
               for ep in entry_points(group="torch_dynamo_backends"))


#: Whether this fullcg is installed (``pip install -e .``), so that ``backend="fullcg"``
#: resolves through the package's entry point as it does for users.
FULLCG_INSTALLED = _fullcg_entry_point()
if not FULLCG_INSTALLED:
    # Run from a checkout on the path without installing it (as on a GPU machine with a
    # read-only environment): the name is registered by hand, so the tests of
    # ``backend="fullcg"`` still test the backend; test_backend's entry-point test skips.
    import torch._dynamo

    from fullcg.backend import fullcg_backend

    torch._dynamo.register_backend(fullcg_backend, name="fullcg")
