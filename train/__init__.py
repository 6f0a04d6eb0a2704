"""`specheads train`: fit an acceptance head on a labelled dataset from `specheads gen`.

Lightning's CLI (`cli`) over `AcceptanceModule` (`module`), which builds the head from the registry, starts its
output layer at the logistic regression of the draft's own signals (`probe`), trains it with the weighted binary
cross-entropy on soft labels (`loss`), and fits the per-position calibration on held-out tokens (`calibration`);
`draft` loads the dataset's draft model where features are computed online.
"""
