"""privreg's Prefect flows, one file per user-facing flow.

Importing the package prepares how this process runs Prefect (see ``flows.runtime``).
"""

from flows import runtime

runtime.install()
