"""What the entry points (train, sample, export, plan, prepare) share: the command line's
errors in one line each (`command_line`) and the one mapping from a failure to the line it
prints and the exit status it ends with (`exits`)."""
