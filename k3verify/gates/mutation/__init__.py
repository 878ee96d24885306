"""The mutation runner and its line probe: run the catalog (k3verify/mutations/) against the parity checks."""
