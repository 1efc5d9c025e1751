"""How a call reaches a kernel: the operators' lean registration with torch's dispatcher
(``torch.ops.mixgemm``, :mod:`.library`), whether a device can run the kernels (:mod:`.checks`),
which kernel and split each call gets: the heuristic, the measured tuning tables
(``configs/<gpu>.json``) and the cached launch plans; and what decides the kernels a layer can
launch, as the layer reports it (:mod:`.uses`, for building them ahead of time)."""
