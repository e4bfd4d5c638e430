"""``trainvitals report LOGDIR``: a health report per run, read from its TensorBoard event files.

No Lightning import anywhere here, and nothing imported by this package itself, so that the command starts
quickly:

- :mod:`.command`: the command — arguments, exit status, output;
- :mod:`.events`: event files read record by record, checksums checked, the damage found and named;
- :mod:`.model`: a run's rows, findings, sections' steps and exit status;
- :mod:`.convergence`: the noise-band verdict and the noise-scale section; :mod:`.assess`: the other sections
  (batch and lr, integrity, memory, spikes) and the findings; :mod:`.schedule`, :mod:`.guard`, :mod:`.updates`:
  the sections of BandSchedule, TrainingGuard, UpdateMonitor and ActivationMonitor;
- :mod:`.render`: text, markdown and JSON; :mod:`.html`: one self-contained HTML page with plots.
"""
