"""`repro watch`: the capture hooks in a program that does not know. command: the CLI side (runs CMD,
its environment, signals, the report; parent-side, no torch); settings: the REPRO_WATCH_* variables
both sides read; hooks/: in every watched process, started by _site/sitecustomize.py or vllm_plugin,
importing no torch until the program does; report: records to the watch view model; ray: the hooks
in Ray workers and the collector.
"""
