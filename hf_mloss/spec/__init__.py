"""The recipe: what to merge and how (config, options, selection grid, mergekit mapping, schedules,
slices). Descriptions only: nothing here loads a model or runs a merge."""
