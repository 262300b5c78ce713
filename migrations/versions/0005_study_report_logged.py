"""studies.report_logged: the scheduler logs a finished study's report to its parent run.

`GET /v1/studies/{id}/report` used to write the report to MLflow itself (a GET waiting on
MLflow; concurrent requests logging the same metric points twice). Studies from before keep
false: the scheduler logs each once, and one whose parent run ended already is only marked.

Revision ID: 0005
Revises: 0004
Create Date: 2026-11-29
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = '0005'
down_revision: str | None = '0004'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table('studies') as batch_op:
        batch_op.add_column(sa.Column('report_logged', sa.Boolean(), nullable=False,
                                      server_default=sa.false()))
        batch_op.create_index(batch_op.f('ix_studies_report_logged'), ['report_logged'],
                              unique=False)


def downgrade() -> None:
    with op.batch_alter_table('studies') as batch_op:
        batch_op.drop_index(batch_op.f('ix_studies_report_logged'))
        batch_op.drop_column('report_logged')
