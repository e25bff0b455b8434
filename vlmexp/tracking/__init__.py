"""MLflow, for both the pipeline's process and a stage's: the tracker (`tracker`), logged models
(`logged_models`), registration (`registration`), a stage's run (`stage_run`) and its Trainer callbacks
(`callbacks`). It imports neither `vlmexp.pipeline` nor `vlmexp.train`."""
