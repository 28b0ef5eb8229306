"""The paper's experiments as commands: max tolerable LR, sweeps, layer redundancy, and the report over them.

Flat modules, by role (each command is `keel.experiments.<command>`, as `keel paper-run` and keel.cli address them):

    data        grids (the paper's grids), roles (what `keel paper-report` reads each grid as)
    records     records (every file a run leaves and its readers)
    runners     maxlr, sweep, redundancy; what they share: axes (grid axes), launch (grid cells, SLURM arrays),
                timing (a run's CPU and wall time, Lightning); paper_run runs the grids
    reports     maxlr_report (`keel maxlr collect`), table1, trends, hold, trained, paper (`keel paper-report`), over
                stats (the shared statistics), tables and plots
"""
