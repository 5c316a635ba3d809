"""privreg's command-line entry point (the flows live in ``flows/``)."""
