import os
import sys

# Tests import their shared helpers (batches.py) by module name.
sys.path.insert(0, os.path.dirname(__file__))
