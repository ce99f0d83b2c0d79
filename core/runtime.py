"""The old home of the runtime services, now one module per job: core/seeding.py (seeds),
core/launch.py (the processes of a launch), core/precision.py (precision, the launcher's
included), core/accelerator.py (a stage's Accelerator), core/version.py (the code's version).

Kept only for `code_version`, which stages/fit_generator/recheck.py still imports from here;
import it from core.version.
"""

from core.version import code_version

__all__ = ["code_version"]
