"""Command plugins' runner: an external program in its own process tree, limited, watched, and killed whole.

template renders the argument list; spawn starts the child with a scrubbed environment and its rlimits;
output spools its stdout and keeps its stderr within bounds; processes shares one scan of the host's process
table among all commands; tree finds, measures and kills a command's processes; runner ties one run together;
artifacts finds the files a command's globs name once it has run.
"""

from .output import CommandResult
from .processes import WatchStatistics, statistics
from .runner import CommandLimits, ran_out_of_files, run_command
from .spawn import scrubbed_env
from .template import check_template, render_argv
from .tree import hurry, kill_leftover_runs

__all__ = [
    "CommandLimits",
    "CommandResult",
    "WatchStatistics",
    "check_template",
    "hurry",
    "kill_leftover_runs",
    "ran_out_of_files",
    "render_argv",
    "run_command",
    "scrubbed_env",
    "statistics",
]
