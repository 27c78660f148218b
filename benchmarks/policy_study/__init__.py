"""The scheduling-policy study (``python -m benchmarks policy-study``): the four policies on offline,
online and capacity workloads, written up as a markdown report with plots.

Runs in the study's own process: ``study`` drives it, ``server`` starts and always stops each
``conveyor serve`` it measures, ``report`` writes the tables, sentences and plots.
"""
