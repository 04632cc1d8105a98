#!/usr/bin/env bash
# A rank that dies must end the job with an error, not leave the others hanging in a collective:
# rank 1 exits while rank 0 waits in a barrier; mpirun must return non-zero within 60 s.
# Usage: dead_rank.sh MPIEXEC TEST_BINARY
set -u
mpiexec="$1"; bin="$2"
t0=$(date +%s)
MD_MPI_TEST_DIE=1 timeout 60 "$mpiexec" --oversubscribe -np 2 "$bin" > /tmp/md-dead-rank.log 2>&1
rc=$?
dt=$(( $(date +%s) - t0 ))
if [ $rc -eq 124 ]; then
  echo "FAIL: the job hung for 60 s after a rank died"; cat /tmp/md-dead-rank.log; exit 1
fi
if [ $rc -eq 0 ]; then
  echo "FAIL: the job reported success although a rank died"; cat /tmp/md-dead-rank.log; exit 1
fi
echo "ok: the job ended with status $rc after ${dt} s when rank 1 died"
