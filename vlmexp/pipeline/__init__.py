"""What the pipeline's own process does, without Prefect (flows/ and tasks/ wrap these):

- `keys`: the resolved config of a run, the keys that decide whether a stage must run again, stage folders;
- `processes`: running a stage's launch command, streaming its output, stopping it and everything it started;
- `steps`: a training stage and an evaluation as the pipeline runs them (in-process or as a deployment);
- `report`: the evaluation run, curves and plots.

MLflow itself (the tracker, logged models, registration) is `vlmexp.tracking`, which a stage's process uses
too.
"""
