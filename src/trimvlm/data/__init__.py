"""Reading local copies of datasets (benchmark files in the layouts Hugging Face publishes): no model, no
evaluation; `trimvlm.evals.tasks` builds tasks from what is read here."""
