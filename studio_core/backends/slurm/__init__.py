"""The Slurm run backend: options.py is what a user chooses for a job (studio.slurm), tools.py
talks to Slurm's commands and checks what a user types for it, backend.py submits, follows and
stops a run as one Slurm job, node.py is a node's part (its supervisor's), job_start.py the
batch job's first step, records.py what the run folder keeps of its jobs and nodes, array.py a
sweep's runs as one job array."""
