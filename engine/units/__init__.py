"""Where each unit runs: the unit layout as data and the builders that load units from it."""
