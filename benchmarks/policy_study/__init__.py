"""The scheduling-policy study (``python scripts/policy_study.py``): the four policies on offline,
online and capacity workloads, written up as a markdown report with plots.

Runs in the study's own process: ``study`` drives it, ``server`` starts and always stops each
``conveyor serve`` it measures, ``report`` writes the tables, sentences and plots.
"""
