"""The project's code location with Dagster's in-process executor, for end-to-end tests on small machines.

Same assets, sensors, jobs and resources as ``qk_assets.defs``; only the executor differs: each run executes its
steps in its own worker process instead of one process per step, so a run imports the code once (several seconds
of CPU per import on a 2-core CI machine). Served under the project's location name, ``qk_assets``.
"""

from dagster import Definitions, in_process_executor

from qk_assets.definitions import defs as project_defs

defs = Definitions.merge(project_defs, Definitions(executor=in_process_executor))
