"""API tokens move from DRF's ``authtoken_token`` (clear text) to django-rest-knox (SHA-512 digests), in place.

Each existing key becomes a knox row whose digest is knox's hash of that key and whose lookup key is its
first 15 characters, so a token handed out before this release keeps working; then ``authtoken_token``,
the clear-text table, is dropped. A database that never had it (a new install) has nothing to move.
Not reversible: the clear text is gone.
"""

from django.db import migrations


def move_tokens(apps, schema_editor):
    from knox.crypto import hash_token
    from knox.settings import CONSTANTS

    connection = schema_editor.connection
    if "authtoken_token" not in connection.introspection.table_names():
        return
    auth_token = apps.get_model("knox", "AuthToken")
    with connection.cursor() as cursor:
        cursor.execute("SELECT key, user_id, created FROM authtoken_token")
        rows = cursor.fetchall()
    auth_token.objects.bulk_create([
        auth_token(digest=hash_token(key), token_key=key[:CONSTANTS.TOKEN_KEY_LENGTH], user_id=user_id,
                   created=created, expiry=None)
        for key, user_id, created in rows])
    schema_editor.execute("DROP TABLE authtoken_token")


class Migration(migrations.Migration):
    dependencies = [("knox", "0009_extend_authtoken_field")]

    operations = [migrations.RunPython(move_tokens, migrations.RunPython.noop, elidable=False)]
