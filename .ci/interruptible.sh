# Sourced by .ci/run (and by tests/test_project.py, which interrupts it).
#
# run_interruptibly COMMAND [ARGS...] runs the shell command COMMAND with ARGS in a process group of its own
# and waits for it. Ctrl-C, or SIGTERM to the shell that runs it, interrupts it as Ctrl-C in its terminal
# would: SIGINT to that whole group, so nox ends its session through the session's cleanup (the cluster
# session's `finally` stops the SLURM daemons it started) and the test processes end; then it returns 130
# (Ctrl-C) or 143 (SIGTERM). Run in the foreground instead, SIGTERM to .ci/run ended the shell and left nox
# running, and SIGTERM to the group ended nox before any cleanup ran.
run_interruptibly() {
    local command=$1 job status signal_status=
    shift
    set -m # job control: the command gets a process group of its own, where SIGINT keeps its default
    (eval "$command" '"$@"') &
    job=$!
    set +m
    trap 'signal_status=130; kill -INT -- "-$job" 2>/dev/null' INT
    trap 'signal_status=143; kill -INT -- "-$job" 2>/dev/null' TERM
    while :; do
        status=0
        wait "$job" || status=$? # a trapped signal ends the wait early: wait again, for the command to end
        kill -0 "$job" 2>/dev/null || break
    done
    trap - INT TERM
    return "${signal_status:-$status}"
}
