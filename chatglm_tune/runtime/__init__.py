"""The process and its files, beneath every other room but `options`: `checkpoint` (safe weight loading: safetensors
and weights-only torch files; placement; atomic saving), `heap` (freed heap given back to the system, 2 MB pages),
`openmp` (idle OpenMP workers handed back), `cores` (the cores a process may use, and how busy they are), `stopping`
(SIGTERM and SIGUSR1 taken as Ctrl-C), `crashpoints` (named moments a crash test kills the process at) and
`leftovers` (temporary files named after their writer, so that a killed writer's are removed). Nothing here imports
another room but `options`."""
