"""Helpers the tests share, not tests themselves: the SLURM variables a real cluster sets
(slurm_env), jobs on the CI's SLURM cluster (slurm_jobs), and every launch of the
workbook read from the source (launch_sites)."""
