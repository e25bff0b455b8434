"""MLflow, for both the pipeline's process and a stage's, and the one package that imports mlflow: the
pipeline's tracker (`tracker`), logged models (`logged_models`), registration (`registration`), a stage
process's run, its one logger (`stage_run`), and the Trainer callbacks that log through it (`callbacks`). It
imports neither `vlmexp.pipeline` nor `vlmexp.train`."""
