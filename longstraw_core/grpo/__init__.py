"""The GRPO step over an adapter: the group loss, the branch replay, the reference policy,
a generation batch's updates and the groups' shares over ranks."""
