"""Science and I/O library of the QK geometry platform. Never imports Dagster."""
