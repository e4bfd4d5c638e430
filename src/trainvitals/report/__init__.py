"""What users look at: the TensorBoard dashboard (:mod:`.layout`) and ``trainvitals report`` (:mod:`.report`).

Nothing is imported here, so that ``trainvitals report`` does not pay for importing Lightning.
"""
