#!/bin/bash
SECRET=/tmp/sl/tr-$SLURM_JOB_ID.secret; touch $SECRET
trap 'rm -f "$SECRET"' EXIT
sleep 60 &
wait $!
