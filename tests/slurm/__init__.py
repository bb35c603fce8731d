"""Tests of scripts/slurm against a real Slurm 22.05."""
