"""The Slurm run backend: tools.py talks to Slurm's commands and checks what a user types for it,
backend.py submits, follows and stops a run as one Slurm job."""
