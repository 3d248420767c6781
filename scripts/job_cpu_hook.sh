# Per-job CPU seconds of a Snakemake run, for docs/workflow.md's measurements:
#
#   BASH_ENV=$PWD/scripts/job_cpu_hook.sh VQPIPE_JOB_TIMES=$PWD/job-times.log make run
#   python scripts/job_times.py job-times.log
#
# Snakemake runs every job's shell command with bash, which sources $BASH_ENV first. For a stage
# command (python -m vqpipe ...) this hook appends, when the job's shell exits, its start and end
# times, the command, and bash's `times`: the CPU seconds of the shell and of its waited-for
# descendants (the stage and every process it ran), which Snakemake's `benchmark:` sampling
# misses for short-lived children.
if [[ "${BASH_EXECUTION_STRING:-}" == *"python -m vqpipe "* && -n "${VQPIPE_JOB_TIMES:-}" ]]; then
  __vqpipe_t0=$(date +%s.%N)
  trap '{ printf "JOB %s %s %s\n" "$__vqpipe_t0" "$(date +%s.%N)" "$(printf %s "$BASH_EXECUTION_STRING" | grep -o "python -m vqpipe .*" | head -1)"; times; } >> "$VQPIPE_JOB_TIMES"' EXIT
fi
