"""The operator dashboard: pages (Django templates + static JS/Plotly) and Channels consumers."""
