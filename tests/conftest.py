import os
import sys

# Tests import their helpers (harness, toy) as top-level modules; ranks are forked from a server
# that must find them too.
sys.path.insert(0, os.path.dirname(__file__))
os.environ["PYTHONPATH"] = os.path.dirname(__file__) + os.pathsep + os.environ.get("PYTHONPATH", "")
