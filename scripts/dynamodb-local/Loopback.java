// Loopback starts Amazon's DynamoDB Local listening on one address only.
// DynamoDB Local has a -port option but none for the address, and listens
// on every interface: a database without authentication open to the
// network. This launcher builds the server from DynamoDB Local's own
// command line (ServerRunner.createServerFromCommandLineArgs), sets the
// host of its Jetty connectors, and starts it.
//
//   java -cp DynamoDBLocal.jar:DynamoDBLocal_lib/*:<this class's dir> \
//        -Djava.library.path=DynamoDBLocal_lib Loopback 127.0.0.1 -port 8001 -inMemory ...
//
// scripts/dynamodb-local.sh compiles it into its cache directory and runs
// it. It reaches a private field of DynamoDB Local (DynamoDBProxyServer's
// Jetty server), so it is tied to the version that script pins, and fails
// loudly, never listening anywhere, if that field is not there.
import com.amazonaws.services.dynamodbv2.local.main.ServerRunner;
import com.amazonaws.services.dynamodbv2.local.server.DynamoDBProxyServer;
import java.lang.reflect.Field;
import java.util.Arrays;
import org.eclipse.jetty.server.Connector;
import org.eclipse.jetty.server.Server;
import org.eclipse.jetty.server.ServerConnector;

public final class Loopback {
    public static void main(String[] args) throws Exception {
        if (args.length < 1) {
            System.err.println("usage: Loopback HOST [DynamoDB Local options...]");
            System.exit(2);
        }
        String host = args[0];
        DynamoDBProxyServer server =
                ServerRunner.createServerFromCommandLineArgs(Arrays.copyOfRange(args, 1, args.length));
        Field f = DynamoDBProxyServer.class.getDeclaredField("server");
        f.setAccessible(true);
        Server jetty = (Server) f.get(server);
        Connector[] connectors = jetty.getConnectors();
        if (connectors.length == 0) {
            throw new IllegalStateException("DynamoDB Local's Jetty server has no connector to bind to " + host);
        }
        for (Connector c : connectors) {
            ((ServerConnector) c).setHost(host);
        }
        server.start();
        System.err.println("Loopback: DynamoDB Local listening on " + host);
    }
}
